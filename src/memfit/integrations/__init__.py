"""memfit inside the training stacks people already use: Hugging Face Trainer and TRL (`transformers`),
Lightning (`lightning`), plain and Accelerate loops (`loops`). Each sits on top of the planner and imports its
stack only when used: `import memfit` never imports transformers, trl, lightning or accelerate."""

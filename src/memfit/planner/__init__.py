"""Planning: the step-time model, device calibration, and the search for the fastest configuration that fits."""

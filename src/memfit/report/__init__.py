"""What the user sees: rich tables for the terminal, plots, JSON."""

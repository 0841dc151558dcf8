"""Energy in the training run: measure, profile, deploy a clock plan on the instruction hooks, or
all of it in the background (``energy_mode="auto"``)."""

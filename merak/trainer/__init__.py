"""MerakTrainer and MerakArguments: the Hugging Face Trainer drop-in."""

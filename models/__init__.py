"""clover.models: the base decoder (Llama family), draft heads and their checkpoints."""

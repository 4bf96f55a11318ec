"""The measurement commands: where the weights and the time of a Block go."""

"""The offline half of kvcal: passes over a model that turn activations into bundle statistics and decisions."""

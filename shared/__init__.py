"""Code shared by the batchgate gateway and GPU workers: wire messages, Redis key layout, lanes, config."""

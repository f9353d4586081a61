"""The batchgate gateway: stateless handlers that put requests on Redis lane streams and read results."""

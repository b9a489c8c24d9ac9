"""Ray and Ray Tune: connecting to a cluster, sizing Tune for it, the trainable, trial actors' reuse and faults,
nodes that cannot import the project. Nothing here knows MLflow or the sweep's stages."""

"""Ray control: placement (bundles for pipelines and Serve replicas) and the compiled-graph
pipeline of stage actors."""

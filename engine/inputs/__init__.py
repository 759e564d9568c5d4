"""Input processing: a request's images and documents, its chat template and tokens, and the limits it must keep."""

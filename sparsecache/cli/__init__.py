"""The `sparsecache` command line: thin click wrappers over library calls of the same names."""

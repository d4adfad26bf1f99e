"""JupyterHub spawner that acquires a GPU slice from the broker before starting a server."""

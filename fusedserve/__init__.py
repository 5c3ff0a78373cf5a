"""The `fusedserve` console script: a thin entry point over `service` and `bench`."""

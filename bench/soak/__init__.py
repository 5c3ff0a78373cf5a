"""`fusedserve bench soak`: minutes of good and hostile clients against the real service (clients.py); cli.py
parses the flags, run.py runs the server and the clients and checks that nothing was lost or grew."""

"""Code the probe runs inside the target, on a probe thread, with the GIL held.

Each module is imported on the first request that needs it. Nothing here may
raise into user code: the callers run on the probe's own threads, and every
error is turned into an answer for the client.
"""

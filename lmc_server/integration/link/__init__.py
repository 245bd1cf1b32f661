"""The connector's connection to the server, driven from a background thread.

``link`` (:class:`~lmc_server.integration.link.link.ServerLink`: one asyncio client on
its own thread, futures for the engine's synchronous hooks, back-pressure,
reconnection), ``batches`` (a step's stores and retrieves carried in few requests) and
``lookups`` (the scheduler's lookups, hashed and sent together on the link's thread).
"""

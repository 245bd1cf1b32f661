"""The daemon: asyncio (uvloop) event loop, zmq ROUTER, sessions, handlers, lifecycle."""

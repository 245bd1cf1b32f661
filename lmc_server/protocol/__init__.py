"""The wire protocol, sans-IO: typed messages, frame codec, error codes, limits.

Nothing here imports zmq or asyncio: the server and the client feed frames in and take
frames out. Messages are msgspec Structs encoded as msgpack maps; unknown fields and
unknown message types are refused; digests and block ids are raw bytes.
"""

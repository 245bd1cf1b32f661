"""Engine integrations built on the client library.

``lmc_server.integration.planning`` (what to look up, store and retrieve, per request;
its parts, one job each: ``tracked``, what is remembered per request; ``arrivals``, new
requests admitted in one loop; ``answered``, a round's answers settled as they come,
so that each question is a dictionary pop; ``stores``, the store rule; ``loads``, a step's loads
planned together; ``lookups``, the lookups' queue, their wait budget, the wait for L2),
``lmc_server.integration.chunks`` (chunk arithmetic over block tables),
``lmc_server.integration.plans`` (the values planning hands the link and the workers),
``lmc_server.integration.worker`` (transfer bookkeeping) and
``lmc_server.integration.kvlayout`` (an engine's KV cache as plain descriptors, and the
registration derived from them) are plain Python, tested in CI without any engine
installed. ``lmc_server.integration.vllm`` is the thin vLLM adapter;
importing this package never imports vLLM or torch.
"""

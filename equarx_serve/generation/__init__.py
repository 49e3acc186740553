"""Step-wise generation: the parts a serving engine is built from, each testable alone.

    sampling.py     SamplingParams (one request's settings) and the on-device sampler
    detokenizer.py  incremental text with stop strings (held back, never streamed)
    batching.py     BatchPolicy: the one owner of batch padding and of the all-reduces a step
                    makes (how many, what size, which collective, bytes on the wire)
    kv_cache.py     slots of the KV cache: which request holds which row, the capacity
    steps.py        the device steps (prefill, decode, release), plain data every process runs
    runner.py       DeviceRunner: runs a step on the mesh; its compiled programs
    engine.py       StepEngine: add_request / step() / abort, typed events
    replicated.py   one step on a mesh that spans processes: process 0 decides and broadcasts,
                    followers run the same step; a lost follower fails the leader fast
    text.py         the Gemma 3 chat template, a byte tokenizer for random-init models

`generator.Generator` is the batch API on top (a loop over the step engine), and
`equarx_serve.server` the OpenAI-compatible HTTP layer.
"""

"""The model runners: one module per model family behind one interface (base.py), picked by registry.py.

  base.py        ModelRunner (prepare a batch of FrameRefs, infer) and PostProcessor (a family's stage after
                 the workers, run on the pool's output thread)
  registry.py    model families as plug-ins: `models.<name>` in the config -> the module that builds its pool
  classify.py    any timm classifier
  sam2*.py       SAM 2: the image-encoder runner, and the tracking stage (memory attention, mask decoder,
                 memory encoder) run for every object of every stream
  noop.py        the model that does nothing (engine overhead, fault injection, sizing)
  preprocess.py, weights.py, device.py: the model's own preprocessing contract, strict weights, the device
  batch_preprocess.py, colour.py: NV12 (NVDEC) or RGB frames -> the model's input as one batched op
  graphs.py      GraphDispatcher: which CUDA graphs exist, padding a batch to the next captured size

Why a package: a model runner knows tensors and its own contract, never the engine's threads, rings or
sockets. May import: engine.errors, engine.util, engine.config, engine.sched, engine.frames (FrameRef and
its lifecycle only, never the ring).
"""

"""Generative engines: decode token sequences step by step.

`base` is the interface the agent's scheduler drives (start a sequence, one
`step` gives every running sequence its next token, `stop` frees a sequence at
once); `onnxruntime_genai_engine` runs a model made by onnxruntime-genai's
builder (INT4 or FP16 for the edge and regional tiers). The heavy libraries
are imported only by the engine that needs them.
"""

"""The frontend: text in, text out.

Turns prompts and chat messages into EngineCoreRequests (tokenizer, chat
template, validation, internal request ids) and EngineCoreOutputs back into
RequestOutputs (incremental detokenization, stop strings, output kinds, n>1,
logprobs, per-request metrics). It knows nothing about KV blocks.
"""

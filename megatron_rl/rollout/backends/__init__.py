"""The engines a rollout worker process runs (``rollout.worker.BACKEND_CLASSES`` names them).

Modules: `hf` (the transformers engine: own batched decode loop; `hf_experts` maps checkpoint
expert names onto transformers' fused expert tensors, `hf_routes` records MoE routing) and
`vllm` (one in-process vLLM engine, stepped by `rollout.stream_worker`; every vLLM call goes
through `vllm_api`, one adaptor per engine family, whose symbols `vllm_api_check` verifies
against a release).
"""

"""Fused shared-prompt attention kernels, installed as ``megatron_rl_kernels``.

``triton_shared_prompt``: block-sparse flash attention (CUDA; CPU tests under the Triton
interpreter), with its host-side ``triton_block_plan``. ``npu_args``: the exact
``torch_npu.npu_fusion_attention`` call (Ascend). Each is tested against an independent PyTorch
computation; neither is imported by default.
"""

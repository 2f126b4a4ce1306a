"""Small Qwen3 and Qwen3-MoE configurations that cover the model's shapes, for the parity tests
(tests/model/test_parity.py) and the float8 KV cache's accuracy (tests/model, bench/fp8_kv_accuracy.py)."""

from worker.model.presets import qwen3_config, qwen3_moe_config

# The suite's small dense shape for the tests that run a checkpoint through the engine, the queue
# and tensor parallelism, as qwen3_config's keyword arguments (a test changes what it needs):
# weights at 0.3, so greedy outputs vary from token to token; 4 heads on 2 KV heads.
SMALL_DENSE = dict(
    vocab_size=2048,
    max_position_embeddings=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
)

# GQA ratios 1, 2 and 4; tied and untied embeddings; head_dim 64 and 128. The MoE configs:
# tiny-moe's routing (8 experts, 2 per token, renormalized) in every layer; and 6 experts, 3
# per token, not renormalized, with a dense layer between sparse ones (mlp_only_layers).
CONFIGS = {
    "gqa1-hd64-tied": qwen3_config(
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "gqa2-hd128-untied": qwen3_config(
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "gqa4-hd64-untied": qwen3_config(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
    ),
    "gqa4-hd128-tied": qwen3_config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    "moe-e8-k2-renorm": qwen3_moe_config(
        hidden_size=64,
        intermediate_size=192,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "moe-e6-k3-dense-layer": qwen3_moe_config(
        hidden_size=96,
        intermediate_size=160,
        moe_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=False,
    ),
}

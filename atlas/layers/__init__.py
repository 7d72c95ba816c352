"""Decoder-layer blocks of Qwen3-family models: attention.py (Qwen3AttentionLayer), ffn.py (dense
SwiGLU MLP, sparse MoE), mtp.py (MtpHead). Import the submodules directly (or use the names
re-exported lazily by `atlas`); nothing is imported here so `import atlas.layers.x` stays cheap."""

"""bhqk inside other libraries. ``bhqk.integrations.transformers.register()`` puts bhqk under
Hugging Face transformers' attention interface (``attn_implementation="bhqk"``).

Nothing here is imported by ``import bhqk``: transformers stays an optional dependency.
"""

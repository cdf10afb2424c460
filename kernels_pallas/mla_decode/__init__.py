"""Paged MLA attention in absorbed form over the latent cache."""

"""What a tensor-parallel plan says: `TPPlan`, the families' plans, transformers' plan styles."""

"""Model workers, one module per model family, behind one small interface (`base.Worker`)."""

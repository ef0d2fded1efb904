"""Using a trained result: generate, evaluate, caption, classify and export to Hugging Face format."""

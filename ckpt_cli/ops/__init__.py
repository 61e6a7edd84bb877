"""Library operations behind the commands; they return models and never print."""

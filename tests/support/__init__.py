"""What several test modules share, a module per concern (docs/architecture.md#tests)."""

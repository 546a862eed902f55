"""Platform plugins: the hook specifications, the data contract, discovery and selection."""

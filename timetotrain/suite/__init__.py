"""One declaration per benchmark (its tiers, rules, RCPs and shipped bases as data); the registry
(`spec/registry.py`) loads each by name."""

"""A user's own code, outside the arealite package: what tests name in YAML configs."""

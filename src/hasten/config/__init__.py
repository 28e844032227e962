"""Launch configuration: the YAML file format, its loading and the one environment channel."""

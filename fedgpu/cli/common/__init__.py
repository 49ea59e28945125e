"""What the `fedgpu` commands share and that is no command itself: the options, the saved
connections and how a command reaches an aggregator, id prefixes, output for people."""

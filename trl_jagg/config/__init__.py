"""The training config: ``GRPOJaggConfig``, its field groups and the checks each group owns."""

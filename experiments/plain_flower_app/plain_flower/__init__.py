"""A plain Flower app: Flower's FedAvg, optionally under DifferentialPrivacyServerSideFixedClipping."""

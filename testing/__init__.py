"""What only tests and benchmarks use: the fake judge server, the chaos harness, the benchmark report writer, a
private Ray instance, step-wise scripts and the WebVoyager files' location. Nothing a README command runs."""

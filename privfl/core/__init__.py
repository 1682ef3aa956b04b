"""The spine, with no torch: channels, the release pipeline, weighted sums, the run plan, messages, public facts and
configurations (ARCHITECTURE.md, target layout)."""

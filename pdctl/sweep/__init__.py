"""Sweeps: many runs of one template (seeds x a grid of config values), the members that can
share a program trained as one (`pdctl sweep new|run|status|report`)."""

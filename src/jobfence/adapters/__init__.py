"""Adapters: implementations of jobfence's ports, each named after its technology."""

"""Hook machinery: selection, the handle registry, capture, probes and the guard."""

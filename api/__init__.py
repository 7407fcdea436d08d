"""kvdepot api layer: the HTTP control plane and the ZMQ data plane. Parses, validates, calls the
engine facade, maps errors. Holds no cache state of its own."""

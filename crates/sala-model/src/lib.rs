//! The MiniCPM-SALA forward pass.

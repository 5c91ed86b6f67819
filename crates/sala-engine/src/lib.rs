//! Generation: sampling, stop conditions, requests.

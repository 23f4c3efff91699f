//! The gateway's public front ends: gRPC (`duet.v1.Inference`, health, reflection) and the
//! OpenAI-compatible HTTP API with Prometheus metrics; both behind the optional API key.

pub mod auth;
pub mod grpc;
pub mod http;
pub mod http_server;
pub mod openai;
pub mod tools;

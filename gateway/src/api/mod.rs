//! The gateway's public front ends. Today: gRPC (`duet.v1.Inference`, health, reflection).

pub mod grpc;

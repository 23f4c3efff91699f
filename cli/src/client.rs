//! The command-line client: `generate` streams one completion to stdout, `chat` runs an
//! interactive conversation in a session (only each new turn is prefilled).

use std::io::Write;

use duet_proto::pb::inference_client::InferenceClient;
use duet_proto::{channel, pb};
use tokio::io::AsyncBufReadExt;
use tonic::transport::Channel;

use crate::args::{ChatArgs, ClientArgs, GenerateArgs};

fn request(c: &ClientArgs, prompt: pb::generate_request::Prompt) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(prompt),
        max_tokens: Some(c.max_tokens),
        sampling: Some(pb::SamplingParams {
            temperature: Some(c.temperature),
            top_k: Some(c.top_k),
            top_p: Some(c.top_p),
            min_p: Some(c.min_p),
            repetition_penalty: Some(c.repetition_penalty),
            frequency_penalty: Some(c.frequency_penalty),
            presence_penalty: Some(c.presence_penalty),
            seed: Some(c.seed),
            ..Default::default()
        }),
        stop: c.stop.clone(),
        ..Default::default()
    }
}

async fn connect(c: &ClientArgs) -> anyhow::Result<InferenceClient<Channel>> {
    Ok(InferenceClient::new(channel(&c.addr)?))
}

/// What one streamed generation gave.
struct Streamed {
    session_id: String,
    ids: Vec<u32>,
    finished: Option<pb::Finished>,
}

/// Streams a generation, printing text as it arrives.
async fn stream(client: &mut InferenceClient<Channel>, req: pb::GenerateRequest) -> anyhow::Result<Streamed> {
    use pb::generate_response::Event;
    let mut s = client.generate(req).await.map_err(|e| anyhow::anyhow!("{}: {}", code_name(e.code()), e.message()))?.into_inner();
    let mut out = Streamed { session_id: String::new(), ids: Vec::new(), finished: None };
    let mut stdout = std::io::stdout();
    while let Some(msg) = s.message().await.map_err(|e| anyhow::anyhow!("{}: {}", code_name(e.code()), e.message()))? {
        match msg.event {
            Some(Event::Prompt(p)) => out.session_id = p.session_id,
            Some(Event::Token(t)) => {
                out.ids.push(t.id);
                print!("{}", t.text);
                stdout.flush()?;
            }
            Some(Event::Finished(f)) => {
                print!("{}", f.text);
                out.finished = Some(f);
            }
            Some(Event::PromptLogprobs(_)) | None => {}
        }
    }
    println!();
    Ok(out)
}

fn code_name(c: tonic::Code) -> String {
    format!("{c:?}").to_uppercase()
}

pub async fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let prompt = if args.chat {
        pb::generate_request::Prompt::Chat(pb::ChatMessages { messages: vec![pb::ChatMessage { role: "user".into(), content: args.prompt }] })
    } else {
        pb::generate_request::Prompt::Text(args.prompt)
    };
    let out = stream(&mut client, request(&args.client, prompt)).await?;
    if args.verbose {
        eprintln!("ids: {:?}", out.ids);
        if let Some(f) = out.finished {
            let u = f.usage.unwrap_or_default();
            let decode_s = (u.total_time_ns.saturating_sub(u.time_to_first_token_ns)) as f64 / 1e9;
            eprintln!(
                "stop: {:?}; prompt {} tokens ({} prefilled), generated {}; first token after {:.1} ms, {:.1} tokens/s after it",
                pb::StopReason::try_from(f.reason).unwrap_or(pb::StopReason::Unspecified),
                u.prompt_tokens,
                u.prefilled_tokens,
                u.generated_tokens,
                u.time_to_first_token_ns as f64 / 1e6,
                u.generated_tokens.saturating_sub(1) as f64 / decode_s.max(1e-9)
            );
        }
    }
    Ok(())
}

pub async fn chat(args: ChatArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.client).await?;
    let mut session: Option<String> = None;
    let mut pending: Vec<pb::ChatMessage> = args.system.into_iter().map(|s| pb::ChatMessage { role: "system".into(), content: s }).collect();
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    eprintln!("Chatting with the gateway at {} (Ctrl-D to end).", args.client.addr);
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let Some(line) = lines.next_line().await? else { break };
        if line.trim().is_empty() {
            continue;
        }
        pending.push(pb::ChatMessage { role: "user".into(), content: line });
        let mut req = request(&args.client, pb::generate_request::Prompt::Chat(pb::ChatMessages { messages: std::mem::take(&mut pending) }));
        match &session {
            Some(id) => req.session_id = Some(id.clone()),
            None => req.create_session = true,
        }
        let out = stream(&mut client, req).await?;
        if session.is_none() && !out.session_id.is_empty() {
            session = Some(out.session_id);
        }
    }
    if let Some(id) = session {
        let _ = client.close_session(pb::CloseSessionRequest { session_id: id }).await;
    }
    Ok(())
}

//! What the AWS sinks share: where the service is (region, an endpoint for
//! a stand-in or a VPC endpoint), whose credentials (the standard chain,
//! never printed), and the HTTPS client.
//!
//! - [`kinesis`]: Amazon Kinesis Data Streams, `PutRecords` batches;
//!   [`kinesis_read`]: reading a stream back, and a dead-letter stream's
//!   letters after a replay's progress marker.
//! - [`sns`]: Amazon SNS, FIFO topics by default, `PublishBatch`, never to
//!   a topic without a subscription;
//! - [`sqs`]: Amazon SQS, FIFO queues by default, `SendMessageBatch`;
//!   [`attributes`]: headers as message attributes, and the FIFO ids.
//! - [`envelope`]: the JSON record a Kinesis record carries.

pub(crate) mod attributes;
pub(crate) mod envelope;
pub(crate) mod kinesis;
pub(crate) mod kinesis_read;
pub(crate) mod sns;
pub(crate) mod sqs;
pub(crate) mod sqs_read;

use serde::Deserialize;

use crate::SinkError;

/// Where an AWS service is and whose credentials walbox uses there. The
/// credentials come from the standard chain (`AWS_ACCESS_KEY_ID` and
/// `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE` and the shared files, web
/// identity, ECS and EC2 instance metadata); none is ever written in
/// walbox's configuration or printed.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AwsConnection {
    /// The region (default: the chain's, `AWS_REGION` or the profile's).
    #[serde(default)]
    pub region: Option<String>,
    /// The service's URL, for a stand-in (LocalStack, kinesalite) or an
    /// endpoint of a VPC (default: the region's public endpoint).
    #[serde(default)]
    pub endpoint_url: Option<String>,
    /// The profile of the shared files (default: `AWS_PROFILE`, else
    /// `default`).
    #[serde(default)]
    pub profile: Option<String>,
    /// Credentials given by the program instead of the chain's (never from
    /// a file: the tests' and the demo's stand-ins). Their `Debug` form
    /// hides the secret.
    #[serde(skip)]
    pub credentials: Option<aws_credential_types::Credentials>,
}

impl AwsConnection {
    /// Checks what can be checked without a request.
    pub(crate) fn validate(&self, table: &str) -> Result<(), SinkError> {
        if let Some(url) = &self.endpoint_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(SinkError::Config(format!(
                "{table}.endpoint_url: {url:?} is no http:// or https:// URL"
            )));
        }
        Ok(())
    }

    /// The SDK's configuration: the region, the endpoint, the credentials
    /// chain, and an HTTPS client on rustls with ring.
    pub(crate) async fn sdk_config(&self, table: &str) -> Result<aws_config::SdkConfig, SinkError> {
        use aws_smithy_http_client::tls;
        // Hyper on rustls with ring (the provider walbox installs for the
        // process), the system's roots; every call bounded in time, so that
        // a call without an answer is sent again instead of holding its keys.
        let https = aws_smithy_http_client::Builder::new()
            .tls_provider(tls::Provider::Rustls(
                tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let timeouts = aws_config::timeout::TimeoutConfig::builder()
            .connect_timeout(std::time::Duration::from_secs(5))
            .operation_attempt_timeout(std::time::Duration::from_secs(15))
            .operation_timeout(std::time::Duration::from_secs(45))
            .build();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .http_client(https)
            .timeout_config(timeouts);
        if let Some(region) = &self.region {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        if let Some(url) = &self.endpoint_url {
            loader = loader.endpoint_url(url.clone());
        }
        if let Some(profile) = &self.profile {
            loader = loader.profile_name(profile.clone());
        }
        if let Some(credentials) = &self.credentials {
            loader = loader.credentials_provider(credentials.clone());
        }
        let config = loader.load().await;
        if config.region().is_none() {
            return Err(SinkError::Config(format!(
                "{table}.region: no region is set; set it there, or AWS_REGION, or a region \
                 in the AWS profile"
            )));
        }
        // The chain is asked once now, so that no credentials at all stop
        // walbox with the chain's own account of why, instead of every call
        // failing as if the network did.
        if let Some(provider) = config.credentials_provider() {
            use aws_credential_types::provider::ProvideCredentials as _;
            use aws_credential_types::provider::error::CredentialsError;
            if let Err(e) = provider.provide_credentials().await {
                let why = error_text(&e);
                return Err(match e {
                    CredentialsError::CredentialsNotLoaded(_)
                    | CredentialsError::InvalidConfiguration(_) => SinkError::AwsAuthentication {
                        service: table.trim_start_matches("sink.").to_owned(),
                        reason: format!("no credentials from the AWS chain: {why}"),
                    },
                    _ => SinkError::Aws(format!("the AWS credential chain: {why}")),
                });
            }
        }
        Ok(config)
    }
}

/// The text of an SDK error without its debug dump (which could hold
/// request parts): the error's own message chain.
pub(crate) fn error_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// The part of a service's error message walbox shows: its first line,
/// and nothing of a signature error's, whose message quotes the canonical
/// request (with `x-amz-security-token`, the session token).
fn shown_message(code: &str, message: Option<&str>) -> String {
    let signature = matches!(
        code,
        "InvalidSignatureException" | "SignatureDoesNotMatch" | "IncompleteSignature"
    );
    let message = message.unwrap_or("");
    if signature
        || message
            .to_ascii_lowercase()
            .contains("x-amz-security-token")
    {
        return "(the service's message quotes the signed request and is not shown)".to_owned();
    }
    message.lines().next().unwrap_or("").to_owned()
}

/// Whether an SQS error says the queue does not exist (the modeled error,
/// or its code, which an answer without the query-compatibility header
/// carries only in the body).
pub(crate) fn no_such_queue(e: &aws_sdk_sqs::operation::get_queue_url::GetQueueUrlError) -> bool {
    use aws_sdk_sqs::error::ProvideErrorMetadata as _;
    e.is_queue_does_not_exist()
        || matches!(
            e.code(),
            Some("QueueDoesNotExist" | "AWS.SimpleQueueService.NonExistentQueue")
        )
}

/// What the answer to a whole call means, from the error code AWS gave
/// (the same codes across Kinesis, SQS and SNS).
pub(crate) fn call_error<E, R>(
    e: &aws_sdk_kinesis::error::SdkError<E, R>,
    service: &str,
    dest: &str,
) -> crate::batched::CallError
where
    E: aws_sdk_kinesis::error::ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug + 'static,
{
    use crate::DeliveryClass;
    use crate::batched::CallError;
    use aws_sdk_kinesis::error::SdkError;
    match e {
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("(no code)");
            let message = shown_message(code, se.err().message());
            let said = format!("{service} answered {code} for {dest:?}: {message}");
            if code.trim_end_matches("Exception") == "BatchRequestTooLong" {
                return CallError::TooLarge(said);
            }
            match code_class(code) {
                Some(class) => CallError::Fail(class, said),
                None => CallError::Retry(said),
            }
        }
        SdkError::ConstructionFailure(_) => CallError::Fail(
            DeliveryClass::BrokerError,
            format!("building the {service} request: {}", error_text(e)),
        ),
        // The connection, a timeout, an answer that could not be read: the
        // call may be made again.
        _ => CallError::Retry(format!("{service}: {}", error_text(e))),
    }
}

/// The class of an error code that ends the session; `None` for one that
/// may pass (throttling, an internal error, an expired token, which the
/// chain refreshes for a new session, one walbox does not know).
pub(crate) fn code_class(code: &str) -> Option<crate::DeliveryClass> {
    use crate::DeliveryClass;
    Some(match code {
        "ResourceNotFoundException"
        | "AWS.SimpleQueueService.NonExistentQueue"
        | "QueueDoesNotExist"
        | "NotFound"
        | "NotFoundException" => DeliveryClass::UnknownTopic,
        "UnrecognizedClientException"
        | "InvalidSignatureException"
        | "IncompleteSignature"
        | "MissingAuthenticationToken"
        | "MissingAuthenticationTokenException"
        | "InvalidClientTokenId"
        | "SignatureDoesNotMatch" => DeliveryClass::Authentication,
        "AccessDeniedException"
        | "AccessDenied"
        | "AuthorizationError"
        | "AuthorizationErrorException"
        | "InvalidSecurity"
        | "InvalidSecurityException"
        // A topic's or queue's KMS key disabled, gone, or not walbox's to
        // use: every message would fail alike.
        | "KMSDisabled"
        | "KMSAccessDenied"
        | "KMSNotFound"
        | "KMSInvalidState"
        | "KMSOptInRequired"
        | "KmsDisabled"
        | "KmsAccessDenied"
        | "KmsNotFound"
        | "KmsInvalidState" => DeliveryClass::Authorization,
        "InvalidArgumentException"
        | "ValidationException"
        | "ValidationError"
        | "InvalidParameterValue"
        | "InvalidParameterException"
        | "InvalidParameter"
        | "InvalidParameterValueException"
        // SNS's spelling of InvalidParameterValue.
        | "ParameterValueInvalid" => DeliveryClass::BrokerError,
        _ => return None,
    })
}

/// A failure of an AWS sink's setup call (checking or creating a stream,
/// queue or topic) as the sink's error.
pub(crate) fn setup_error<E, R>(
    e: &aws_sdk_kinesis::error::SdkError<E, R>,
    service: &str,
    what: &str,
) -> SinkError
where
    E: aws_sdk_kinesis::error::ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug + 'static,
{
    use aws_sdk_kinesis::error::SdkError;
    if let SdkError::ServiceError(se) = e {
        let code = se.err().code().unwrap_or("(no code)");
        let message = shown_message(code, se.err().message());
        if code_class(code) == Some(crate::DeliveryClass::Authentication) {
            return SinkError::AwsAuthentication {
                service: service.to_owned(),
                reason: format!("{code}: {message}"),
            };
        }
        if code_class(code).is_some() {
            return SinkError::AwsRefused(format!("{service}: {what}: {code}: {message}"));
        }
        return SinkError::Aws(format!("{service}: {what}: {code}: {message}"));
    }
    SinkError::Aws(format!("{service}: {what}: {}", error_text(e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_sdk_kinesis::error::{ErrorMetadata, SdkError};
    use aws_sdk_kinesis::operation::put_records::PutRecordsError;
    use aws_smithy_runtime_api::http::Response;
    use aws_smithy_types::body::SdkBody;

    fn answered(code: &str, message: &str) -> SdkError<PutRecordsError, Response> {
        let error =
            PutRecordsError::generic(ErrorMetadata::builder().code(code).message(message).build());
        SdkError::service_error(
            error,
            Response::new(400.try_into().expect("a status"), SdkBody::empty()),
        )
    }

    #[test]
    fn a_signature_errors_message_never_reaches_walboxs_errors() {
        let quoted = "The request signature we calculated does not match.\n\nThe Canonical \
                      String for this request should have been\nPOST\n/\n\nhost:kinesis\n\
                      x-amz-security-token:TOKEN-1b2c\n";
        for code in [
            "InvalidSignatureException",
            "SignatureDoesNotMatch",
            "SomethingNew",
        ] {
            let e = answered(code, quoted);
            let call = format!("{:?}", call_error(&e, "kinesis", "s"));
            let setup = setup_error(&e, "kinesis", "describing").to_string();
            assert!(!call.contains("TOKEN-1b2c"), "{call}");
            assert!(!setup.contains("TOKEN-1b2c"), "{setup}");
            assert!(call.contains(code), "{call}");
        }
        let plain = format!(
            "{:?}",
            call_error(
                &answered("ThrottlingException", "Rate exceeded\nmore"),
                "kinesis",
                "s"
            )
        );
        assert!(
            plain.contains("Rate exceeded") && !plain.contains("more"),
            "{plain}"
        );
    }

    #[test]
    fn an_expired_token_may_pass_and_refused_keys_stop() {
        assert_eq!(code_class("ExpiredTokenException"), None);
        assert_eq!(code_class("ExpiredToken"), None);
        assert_eq!(
            code_class("UnrecognizedClientException"),
            Some(crate::DeliveryClass::Authentication)
        );
        assert_eq!(code_class("ProvisionedThroughputExceededException"), None);
    }

    #[test]
    fn sns_and_kms_codes_that_would_fail_every_message_end_the_session() {
        use crate::DeliveryClass;
        assert_eq!(
            code_class("ParameterValueInvalid"),
            Some(DeliveryClass::BrokerError)
        );
        for code in [
            "KMSDisabled",
            "KMSAccessDenied",
            "KMSNotFound",
            "InvalidSecurity",
        ] {
            assert_eq!(
                code_class(code),
                Some(DeliveryClass::Authorization),
                "{code}"
            );
        }
        // A throttle may pass.
        assert_eq!(code_class("KMSThrottling"), None);
    }
}
